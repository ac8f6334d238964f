"""``make run``: the development server and a Celery worker with beat, as one job.

``python -m project.serve [ADDRESS]`` starts both. When either stops (a worker that
cannot start, say), the other is stopped too and the exit status says so, rather than a
server that goes on serving with no scheduled job running. Ctrl-C, or a SIGTERM (a
supervisor, ``docker stop``, ``kill`` of ``make``, which passes it on) stops both. Each
runs in a process group of its own, so what it started (Django's autoreloader, Celery's
pool and beat) stops with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

#: How long the children get to stop after a SIGTERM before they are killed.
GRACE_SECONDS = 15


def commands(address: str) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "the Celery worker": [python, "-m", "celery", "-A", "project", "worker", "--beat", "--concurrency=1",
                              "--loglevel=INFO"],
        "the server": [python, "manage.py", "runserver", address],
    }  # fmt: skip


#: What stops the job: Ctrl-C, a supervisor's SIGTERM, a closed terminal's SIGHUP.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main(argv: Sequence[str]) -> int:
    address = argv[1] if len(argv) > 1 else "127.0.0.1:8000"

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for signum in STOP_SIGNALS:  # before any child starts: none is left behind by an early signal
        signal.signal(signum, stop)
    children: dict[str, subprocess.Popen[bytes]] = {}
    status = 0
    try:
        for name, command in commands(address).items():
            children[name] = subprocess.Popen(command, start_new_session=True)
        while status == 0:
            for name, child in children.items():
                code = child.poll()
                if code is not None:
                    print(f"{name} stopped (exit status {code}); stopping the rest.", file=sys.stderr, flush=True)
                    status = code or 1
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


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each child's process group, then SIGKILL what is left after the grace period."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
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
