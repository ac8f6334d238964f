"""``make run``: the development server and a Celery worker with beat, as one job.

``python -m project.serve [ADDRESS]`` starts both. When either stops (a worker that
cannot start, say), the other is stopped too and the exit status says so, rather than a
server that goes on serving with no scheduled job running. Ctrl-C, or a SIGTERM (a
supervisor, ``docker stop``, ``kill`` of ``make``, which passes it on) stops both: each
gets a SIGTERM of its own and stops what it started (Celery lets its pool finish the task
it runs, then stops it and beat), and whatever is left of its process group after the
grace period is killed. On Linux a launcher that is killed outright (``kill -9``, the OOM
killer) takes them with it too: the kernel sends each a SIGTERM when it dies. With
``--stop-with-parent`` (``make run`` passes it), so does what started the launcher, killed
outright: the kernel sends the launcher a SIGTERM, which stops both as above. (Not by
default: a launch with ``nohup ... &`` would stop at the shell's logout.)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

#: How long the children get to stop after a SIGTERM before they are killed.
GRACE_SECONDS = 15

#: prctl(2)'s option to have the kernel signal a process when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def commands(address: str) -> dict[str, list[str]]:
    # --noreload: this is the served job, not an edit loop, and the autoreloader would serve
    # from a grandchild, which neither the SIGTERM below nor the parent-death signal reaches.
    # --insecure: serve the static files (the admin's CSS) with DEBUG off too; runserver
    # serves them anyway with DEBUG on. A production deployment runs gunicorn behind a web
    # server that serves STATIC_ROOT after collectstatic.
    python = sys.executable
    return {
        "the Celery worker": [python, "-m", "celery", "-A", "project", "worker", "--beat", "--concurrency=1",
                              "--loglevel=INFO"],
        "the server": [python, "manage.py", "runserver", "--noreload", "--insecure", address],
    }  # fmt: skip


#: The option that stops the job when what started it dies (``make run`` passes it).
STOP_WITH_PARENT = "--stop-with-parent"

#: What stops the job: Ctrl-C, a supervisor's SIGTERM, a closed terminal's SIGHUP.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main(argv: Sequence[str]) -> int:
    arguments = [argument for argument in argv[1:] if argument != STOP_WITH_PARENT]
    address = arguments[0] if arguments else "127.0.0.1:8000"
    taken = _address_taken(address)
    if taken:  # before the worker and beat start on var/, where a second pair would share the queue
        print(taken, file=sys.stderr, flush=True)
        return 1

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for signum in STOP_SIGNALS:  # before any child starts: none is left behind by an early signal
        signal.signal(signum, stop)
    stop_with_parent = _parent_death_signal(os.getppid()) if STOP_WITH_PARENT in argv else None
    if stop_with_parent is not None:
        stop_with_parent()  # a SIGTERM when make dies, even by SIGKILL
    children: dict[str, subprocess.Popen[bytes]] = {}
    status = 0
    die_with_launcher = _parent_death_signal(os.getpid())
    try:
        for name, command in commands(address).items():
            children[name] = subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_launcher)
        while status == 0:
            for name, child in children.items():
                code = child.poll()
                if code is not None:
                    print(f"{name} stopped (exit status {code}); stopping the rest.", file=sys.stderr, flush=True)
                    status = _exit_status(code)
                    break
            else:
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for signum in STOP_SIGNALS:  # a second Ctrl-C must not cut the stopping short (it ends within the grace)
            signal.signal(signum, signal.SIG_IGN)
        _stop(list(children.values()))
    return status


def _address_taken(address: str) -> str | None:
    """Return why the server could not listen on ``address`` (``[host:]port``), or None if it can.

    Binds as runserver does (``SO_REUSEADDR``), then lets go: a port another server holds is
    said at once, rather than among the worker's start-up lines once runserver finds it.
    """
    host, _, port = address.rpartition(":")
    # runserver binds IPv6 for a [bracketed] address only (or with -6); a host name as IPv4.
    family = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    host = host.strip("[]") or "127.0.0.1"
    try:
        if not 0 < int(port) < 65536:
            return None
        infos = socket.getaddrinfo(host, int(port), family, socket.SOCK_STREAM)
    except (OSError, ValueError):
        return None  # not an address this understands: runserver says what is wrong with it
    family, kind, _, _, sockaddr = infos[0]
    with socket.socket(family, kind) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            return f"Cannot serve on {address}: {exc.strerror}. Choose another port: make run PORT=8001"
    return None


def _parent_death_signal(parent: int) -> Callable[[], None] | None:
    """Return a function that has the kernel SIGTERM the process calling it when ``parent`` dies.

    The launcher calls it for itself, its parent being ``make``, and its children call it
    as their ``preexec_fn``, their parent being the launcher: they run in sessions of their
    own (so a terminal's Ctrl-C reaches them only through the launcher), so nothing else
    stops them if the launcher is SIGKILLed. Where there is no prctl (not Linux), return
    None: there a killed parent leaves them running.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (AttributeError, OSError):
        return None

    def die_with_parent() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before the prctl took effect: no signal will come
            os.write(2, b"the process that started this one has died; stopping.\n")
            os._exit(1)

    return die_with_parent


def _exit_status(code: int) -> int:
    """Return the job's exit status when a child stopped with ``code``.

    A child killed by signal N has returncode -N: a shell's 128 + N says so, where
    ``sys.exit(-N)`` would make 256 - N. A child that stopped by itself, even with 0, fails the job.
    """
    if code < 0:
        return 128 - code
    return code or 1


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each child, then SIGKILL what is left of its process group after the grace period.

    The SIGTERM goes to the child alone, not to its group: Celery's worker stops its pool
    and beat itself (a warm shutdown lets the running task finish), where a SIGTERM of its
    own would kill the pool process mid-task. The server (``--noreload``) is one process.
    """
    for child in children:
        with contextlib.suppress(ProcessLookupError):  # it is gone already
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(child, signal.SIGKILL)
            child.wait()
        _signal_group(child, signal.SIGKILL)  # its own children, if any outlived it


def _signal_group(child: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(child.pid, signum)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
