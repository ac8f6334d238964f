"""The code stays lint-clean (ruff) and type-checks (mypy with django-stubs), as the house style asks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def test_ruff_finds_nothing():
    result = _run("ruff", "check", ".", "--output-format", "concise")
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_is_ruff_formatted():
    result = _run("ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_finds_nothing():
    result = _run("mypy", "afkmemory", "project")
    assert result.returncode == 0, result.stdout + result.stderr
