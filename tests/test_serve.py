"""``make run``'s launcher (``project/serve.py``): the server and the worker stop together."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
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


def _descendants(pid: int) -> list[int]:
    children = _children(pid)
    return children + [grandchild for child in children for grandchild in _descendants(child)]


def _launcher(commands: dict[str, list[str]]) -> subprocess.Popen[bytes]:
    """Start ``project.serve.main`` with its two commands replaced by ``commands``."""
    code = textwrap.dedent(
        f"""
        import sys
        import project.serve as serve
        serve.commands = lambda address: {commands!r}
        sys.exit(serve.main(["serve", "127.0.0.1:1"]))
        """
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True, stderr=subprocess.PIPE)


def _kill(launcher: subprocess.Popen[bytes], children: list[int] | None = None) -> None:
    """SIGKILL the launcher and each child's group: in sessions of their own, they are not in the launcher's."""
    children = list(children or [])
    if launcher.poll() is None:
        children += _children(launcher.pid)
        os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):  # stopped already
            os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def port():
    return _free_port()


def _project_env(tmp_path: Path, **more: str) -> dict[str, str]:
    """The example project's environment on the SQLite database and var directory under ``tmp_path``."""
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "AFKMEMORY_VAR_DIR": str(tmp_path / "var"),
        "DJANGO_SETTINGS_MODULE": "project.settings",
        **more,
    }
    env.pop("REDIS_URL", None)
    return env


@pytest.fixture(scope="module")
def migrated(tmp_path_factory) -> Path:
    """A migrated SQLite database of the example project, which each server starts from a copy of."""
    tmp_path = tmp_path_factory.mktemp("migrated")
    migrate = [sys.executable, "manage.py", "migrate", "-v", "0"]
    subprocess.run(migrate, cwd=ROOT, env=_project_env(tmp_path), check=True, timeout=120)
    return tmp_path / "db.sqlite3"


@pytest.fixture
def served(request, tmp_path, port, migrated):
    """Start ``python -m project.serve`` on a fresh SQLite database; yield it and its two children, once it serves.

    Parametrized indirectly, the parameter is more environment variables.
    """
    env = _project_env(tmp_path, **getattr(request, "param", {}))
    shutil.copyfile(migrated, tmp_path / "db.sqlite3")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "project.serve", f"127.0.0.1:{port}"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    children: list[int] = []
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
        _kill(launcher, children)


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


def test_a_launcher_killed_by_sigkill_leaves_nothing_running(served):
    """The children run in sessions of their own: a SIGKILLed launcher (``kill -9``, the OOM killer)
    left them running, the port taken. The kernel stops them now, and the server is not behind an
    autoreloader, whose server process (a grandchild) nothing would stop."""
    launcher, children = served
    descendants = [pid for child in children for pid in [child, *_descendants(child)]]
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 60  # the worker's warm shutdown
    while [pid for pid in descendants if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in descendants if _alive(pid)]


@pytest.mark.parametrize("option", ["--stop-with-parent", None])
def test_make_killed_by_sigkill_stops_the_launcher_and_what_it_started(option):
    """``kill -9`` of ``make`` left the launcher (then a child of init) serving, with its
    worker and beat. With ``--stop-with-parent``, which ``make run`` passes, the kernel sends
    the launcher a SIGTERM, which stops it all; without it (``nohup ... &`` from a shell that
    then logs out) the launcher serves on."""
    arguments = ["serve", *([option] if option else []), "127.0.0.1:1"]
    code = textwrap.dedent(
        f"""
        import sys
        import project.serve as serve
        serve.commands = lambda address: {{"the Celery worker": ["sleep", "300"], "the server": ["sleep", "300"]}}
        sys.exit(serve.main({arguments!r}))
        """
    )
    # A shell that waits for the launcher (a command after it), as make does.
    make = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "$0"; true', code], cwd=ROOT, start_new_session=True)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(_descendants(make.pid)) < 3:  # the launcher and its two children
            assert make.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        [launcher] = _children(make.pid)
        started = [launcher, *_descendants(launcher)]
        make.kill()
        make.wait()
        if option is None:
            time.sleep(2)  # what a SIGTERM would have stopped by now
            assert all(_alive(pid) for pid in started)
            return
        while [pid for pid in started if _alive(pid)] and time.monotonic() < deadline + 30:
            time.sleep(0.1)
        assert not [pid for pid in started if _alive(pid)]
    finally:
        _kill(make, [make.pid, *started])  # the launcher is in make's group, its children in groups of their own


def test_a_graceful_stop_lets_the_worker_stop_its_own_pool(tmp_path):
    """A SIGTERM to the worker's whole group reached Celery's pool process directly, killing the task
    it ran (and logging "Process 'ForkPoolWorker-2' exited with 'signal 15'") instead of letting the
    worker's warm shutdown stop it. Here a stand-in worker whose child records the first signal it gets."""
    record = tmp_path / "child-signal"
    worker = textwrap.dedent(
        f"""
        import signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", '''
        import signal, sys, time
        def note(signum, frame):
            open({str(record)!r}, "a").write(signal.Signals(signum).name + "\\\\n"); sys.exit(0)
        signal.signal(signal.SIGTERM, note); signal.signal(signal.SIGUSR1, note)
        time.sleep(300)
        '''])
        def stop(signum, frame):  # a warm shutdown: the parent lets its pool finish, then stops it
            time.sleep(0.5); child.send_signal(signal.SIGUSR1); child.wait(); sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        time.sleep(300)
        """
    )
    launcher = _launcher({"the Celery worker": [sys.executable, "-c", worker], "the server": ["sleep", "300"]})
    try:
        time.sleep(3)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 0
    finally:
        _kill(launcher)
    assert record.read_text().split() == ["SIGUSR1"], "the worker's child was signalled by the launcher"


def test_a_child_killed_by_a_signal_makes_the_shells_exit_status():
    """A child killed by SIGKILL has returncode -9, which sys.exit turned into 247; a shell says 137."""
    launcher = _launcher({"the Celery worker": ["sh", "-c", "kill -9 $$"], "the server": ["sleep", "300"]})
    try:
        status = launcher.wait(timeout=30)
    finally:
        _kill(launcher)
    assert status == 128 + signal.SIGKILL


@pytest.mark.parametrize("served", [{"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": "k" * 50}], indirect=True)
def test_the_admin_has_its_css_with_debug_off(served, port):
    """runserver serves static files only with DEBUG on, unless --insecure: /admin/ had no CSS."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/static/admin/css/base.css", timeout=10) as response:
        assert response.status == 200


def _load_settings(tmp_path: Path, environment: dict[str, str], script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` after importing ``project.settings`` as ``s``, with no DJANGO_ variable but ``environment``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_") and k != "REDIS_URL"}
    env.update(AFKMEMORY_VAR_DIR=str(tmp_path), **environment)
    script = f"import project.settings as s; {script}"
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("environment", "loads"),
    [
        ({}, True),
        ({"DJANGO_DEBUG": "0"}, False),
        ({"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": "dev-only-insecure-key-change-me"}, False),
        (
            {
                "DJANGO_DEBUG": "0",
                "DJANGO_SECRET_KEY": "k" * 50,
                "DJANGO_SECRET_KEY_FALLBACKS": "old, dev-only-insecure-key-change-me",
            },
            False,
        ),
        ({"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": "k" * 50}, True),
    ],
)
def test_the_development_key_is_only_for_development(tmp_path, environment, loads):
    """With DJANGO_DEBUG=0 and no DJANGO_SECRET_KEY (or the published one given as
    DJANGO_SECRET_KEY) the settings took the key published in the repository, with which
    anyone could forge what Django signs: they refuse to load now."""
    done = _load_settings(tmp_path, environment, "print(s.SECRET_KEY)")
    assert (done.returncode == 0) == loads, done.stderr[-2000:]
    if not loads:
        assert "ImproperlyConfigured" in done.stderr and "development key" in done.stderr, done.stderr[-2000:]


#: The example project's numeric variables: what each sets, its default, and its least value.
NUMBERS = {
    "CONN_MAX_AGE": ("DATABASES['default']['CONN_MAX_AGE']", 60, 0),
    "AFKMEMORY_SWEEP_EVERY": ("CELERY_BEAT_SCHEDULE['afkmemory-sweep-store']['schedule']", 300, 1),
    "AFKMEMORY_COMPACT_EVERY": ("CELERY_BEAT_SCHEDULE['afkmemory-compact-threads']['schedule']", 3600, 1),
    "AFKMEMORY_MAX_BODY_BYTES": ("DATA_UPLOAD_MAX_MEMORY_SIZE", 4 * 1024 * 1024, 1),
    "AFKMEMORY_EMBEDDING_DIMENSIONS": ("AFKMEMORY['EMBEDDING_DIMENSIONS']", 1536, 1),
}


@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_numeric_variables_that_are_empty_or_not_numbers(tmp_path, name):
    """An empty variable (as compose and .env files leave them) stopped the project with a
    ValueError's traceback, as did a word; -5 passed. Empty is the default; the rest are refused,
    naming the variable."""
    setting, default, least = NUMBERS[name]
    base = {"DATABASE_URL": "postgresql://u@localhost/db"}  # CONN_MAX_AGE is read with DATABASE_URL
    for value, expected in (("", default), (" 42 ", 42)):
        done = _load_settings(tmp_path, {**base, name: value}, f"print(s.{setting})")
        assert done.returncode == 0 and done.stdout.strip() == str(expected), done.stderr[-2000:]
    for value in ("x", "-5", "2.5", "\u00b2", str(least - 1) if least else "-1"):
        done = _load_settings(tmp_path, {**base, name: value}, f"print(s.{setting})")
        assert done.returncode != 0 and f"{name}={value!r}: give a whole number of" in done.stderr, done.stderr[-2000:]
    if name == "CONN_MAX_AGE":  # Django's None: kept as long as they work
        done = _load_settings(tmp_path, {**base, name: "None"}, f"print(s.{setting})")
        assert done.stdout.strip() == "None", done.stderr[-2000:]


@pytest.mark.parametrize("value", ["1h", "-5", "3.5"])
def test_hsts_seconds_that_are_not_whole_seconds_are_refused(tmp_path, value):
    """DJANGO_HSTS_SECONDS=1h stopped the project with a bare ValueError; -5 sent max-age=-5."""
    environment = {"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": "k" * 50, "DJANGO_HTTPS": "1"}
    environment["DJANGO_HSTS_SECONDS"] = value
    done = _load_settings(tmp_path, environment, "print(s.SECURE_HSTS_SECONDS)")
    assert done.returncode != 0 and f"DJANGO_HSTS_SECONDS={value!r}: give a whole number of seconds" in done.stderr


def test_behind_an_https_proxy_check_deploy_has_nothing_to_say_of_cookies_redirects_or_hsts(tmp_path):
    """The example project had no way to mark its cookies secure, redirect plain HTTP or send
    HSTS: ``check --deploy`` warned of all four (W004, W008, W012, W016) with no setting to
    turn. ``DJANGO_HTTPS=1`` (and ``DJANGO_HSTS_SECONDS``) does; without it they stay off, as
    ``make run`` serves plain HTTP."""
    from django.core.management.utils import get_random_secret_key

    production = {"DJANGO_DEBUG": "0", "DJANGO_SECRET_KEY": get_random_secret_key()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_") and k != "REDIS_URL"}
    env.update(AFKMEMORY_VAR_DIR=str(tmp_path), DJANGO_SETTINGS_MODULE="project.settings", **production)

    def warnings_of(extra: dict[str, str]) -> set[str]:
        command = [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "CRITICAL"]
        done = subprocess.run(command, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return set(re.findall(r"security\.W\d+", done.stderr + done.stdout))

    secure = {"security.W004", "security.W008", "security.W012", "security.W016"}
    assert warnings_of({}) >= secure
    assert not warnings_of({"DJANGO_HTTPS": "1", "DJANGO_HSTS_SECONDS": "3600"}) & secure
    assert warnings_of({"DJANGO_HTTPS": "1"}) & secure == {"security.W004"}  # HSTS is the deployment's to choose
    done = _load_settings(tmp_path, {**production, "DJANGO_HTTPS": "1"}, "print(s.SECURE_PROXY_SSL_HEADER)")
    assert done.stdout.strip() == "('HTTP_X_FORWARDED_PROTO', 'https')", done.stderr[-2000:]


@pytest.mark.parametrize(
    ("value", "debug"),
    [("", True), ("1", True), ("true", True), ("True", True), ("YES", True), ("on", True),
     ("0", False), ("false", False), ("No", False), ("OFF", False)],
)  # fmt: skip
def test_django_debug_reads_the_usual_spellings(tmp_path, value, debug):
    """DJANGO_DEBUG=true (anything but "1") turned DEBUG off."""
    done = _load_settings(tmp_path, {"DJANGO_DEBUG": value, "DJANGO_SECRET_KEY": "k" * 50}, "print(s.DEBUG)")
    assert done.stdout.strip() == str(debug), done.stderr[-2000:]


def test_a_django_debug_that_is_not_a_flag_is_refused(tmp_path):
    done = _load_settings(tmp_path, {"DJANGO_DEBUG": "maybe"}, "print(s.DEBUG)")
    assert done.returncode != 0 and "DJANGO_DEBUG='maybe'" in done.stderr


def test_allowed_hosts_are_stripped(tmp_path):
    """DJANGO_ALLOWED_HOSTS="a, b" allowed " b", which no request's host matches."""
    done = _load_settings(tmp_path, {"DJANGO_ALLOWED_HOSTS": " a.example, b.example,,"}, "print(s.ALLOWED_HOSTS)")
    assert done.stdout.strip() == "['a.example', 'b.example']", done.stderr[-2000:]


def test_secret_key_fallbacks_come_from_the_environment(tmp_path):
    """Rotating the key keeps the old one in DJANGO_SECRET_KEY_FALLBACKS: what it signed stays valid."""
    done = _load_settings(tmp_path, {"DJANGO_SECRET_KEY_FALLBACKS": "old-1, old-2"}, "print(s.SECRET_KEY_FALLBACKS)")
    assert done.stdout.strip() == "['old-1', 'old-2']", done.stderr[-2000:]
    done = _load_settings(tmp_path, {}, "print(s.SECRET_KEY_FALLBACKS)")
    assert done.stdout.strip() == "[]", done.stderr[-2000:]


def test_a_redis_password_is_hidden_from_the_debug_page_and_error_reports(tmp_path):
    """REDIS_URL's password is in REDIS_URL, CACHES' LOCATION and CELERY_BROKER_URL, none of whose
    names Django's SafeExceptionReporterFilter hides (it hides DATABASES' PASSWORD)."""
    script = (
        "import django; django.setup();"
        "from django.views.debug import get_default_exception_reporter_filter as f;"
        "print(f().get_safe_settings())"
    )
    environment = {
        "REDIS_URL": "redis://:hunter2redis@127.0.0.1:6390/14",
        "DATABASE_URL": "postgresql://postgres:hunter2pg@127.0.0.1:5432/nothing",
        "DJANGO_SETTINGS_MODULE": "project.settings",
    }
    done = _load_settings(tmp_path, environment, script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hunter2pg" not in done.stdout and "hunter2redis" not in done.stdout


def test_the_apps_log_lines_say_when_at_what_level_and_where(tmp_path):
    """Among Celery's "[time: LEVEL/process]" lines, afkmemory's came bare ("swept 0 expired store items")."""
    script = "import django, logging; django.setup(); logging.getLogger('afkmemory.tasks').info('swept 0 items')"
    done = _load_settings(tmp_path, {"DJANGO_SETTINGS_MODULE": "project.settings"}, script)
    assert re.fullmatch(r"\[\d{4}-\d\d-\d\d [\d:,]+: INFO/afkmemory\.tasks\] swept 0 items\n", done.stderr), done.stderr


def test_a_taken_port_is_said_before_anything_starts(tmp_path, port):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        result = subprocess.run(
            [sys.executable, "-m", "project.serve", f"127.0.0.1:{port}"],
            cwd=ROOT, env=_project_env(tmp_path), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1
    assert f"Cannot serve on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "make run PORT=" in result.stderr
    assert not (tmp_path / "var").exists(), "the worker started"


@pytest.mark.parametrize("address", ["localhost:{port}", "{port}", "[::1]:{port}"])
def test_the_port_check_binds_as_runserver_would(address, port):
    """runserver binds a host name over IPv4, whatever the resolver lists first."""
    from project.serve import _address_taken

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        taken = _address_taken(address.format(port=port))
    assert (taken is None) == address.startswith("[::1]"), taken


def test_a_port_out_of_range_is_left_for_runserver_to_refuse(port):
    from project.serve import _address_taken

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        assert _address_taken(f"127.0.0.1:{port + 65536}") is None  # getaddrinfo would check {port}


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_run_after_make_test_installs_nothing_again(tmp_path):
    """The test requirements include the base ones: once they are installed, ``make run``'s
    install step is up to date (it used to upgrade pip and reinstall, asking the index)."""
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    fake = tmp_path / ".venv" / "bin" / "python"  # what pip would be asked: nothing, here
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)

    def make(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["make", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)

    assert make("-q", "install").returncode == 1  # a fresh checkout installs base
    assert make("install-test").returncode == 0
    assert make("-q", "install").returncode == 0, make("-n", "install").stdout
    later = time.time() + 10
    os.utime(tmp_path / "requirements" / "base.txt", (later, later))  # a changed pin installs again
    assert make("-q", "install").returncode == 1
